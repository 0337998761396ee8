"""A request's token stream at the gateway (choices.py): its Handle (filled by the mesh
client) and the response written from it (SSE or one answer); http/server.py sends it."""
