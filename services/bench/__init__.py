"""`pdmesh bench serve`: the online benchmark (datasets, arrivals, a client per request
through a backend: a pdmesh gateway over gRPC or any OpenAI-compatible server over HTTP,
the metrics `vllm bench serve` reports, a JSON and a PNG)."""
