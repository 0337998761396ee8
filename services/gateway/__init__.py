"""The gateway service: OpenAI-compatible HTTP in front of the mesh. It never loads torch.

service.py (lifecycle) and config.py at the top; below them, by concern:
- http/: the Starlette app, auth, and the server below it (slow-client deadlines, SSE);
- api/: the OpenAI request and response shapes, pure;
- streaming/: a request's Handle and its response, SSE or gathered;
- mesh/: NATS I/O to the workers, link state, migration;
- routing/: which workers a request goes to, pure.
"""
