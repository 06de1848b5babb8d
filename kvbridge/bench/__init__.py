"""Transfer-cost benchmarks and the P/D simulator."""
