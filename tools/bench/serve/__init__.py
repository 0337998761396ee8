"""`moemesh bench serve`: a serving benchmark client for any OpenAI-compatible server.

workload (request streams, pure) -> runner (arrivals, sessions, sweep) -> client (SSE
timing) -> metrics (pure) -> report (JSON, Markdown, PNG)."""
