"""The HTTP side: the Starlette app and its routes, API keys, and the server below them:
the deadlines that keep a slow client from holding a connection, the outermost ASGI
layer, and the SSE response."""
