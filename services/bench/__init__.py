"""`pdmesh bench serve`: the online benchmark (datasets, arrivals, a client per request,
the metrics `vllm bench serve` reports, a JSON and a PNG)."""
