"""kvbridge.vllm: the vLLM adapter (connector classes and plugin); vLLM is imported lazily."""
