"""What runs beside the engines when kvbridge serves: ``kvbridge proxy`` (the P/D proxy and its routing
policies, :mod:`.proxy`, :mod:`.routing`) and ``kvbridge publish`` / the connector's publisher (an engine's
prefix cache published in the block directory for routers, :mod:`.publishing`). Only the publisher reads vLLM (its KV-event classes), and only when it follows an engine's events.
"""
