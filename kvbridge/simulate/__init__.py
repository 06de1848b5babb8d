"""``kvbridge simulate``: a P/D what-if. An event-driven model of engines serving a workload colocated, with
chunked prefill, or disaggregated over a measured KV hand-off (docs/simulate.md).

``model`` is the engine model, ``toy`` the article's toy simulation, ``inputs`` reads bench records and
calibrations, ``stats`` the figures and their confidence intervals, ``plot`` the pictures, ``cli`` the command.
"""
