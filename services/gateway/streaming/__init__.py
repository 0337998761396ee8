"""A request's token stream at the gateway: its Handle (filled by the mesh client), the
response written from it (SSE or one answer), and the ASGI response that sends it."""
