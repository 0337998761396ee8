"""The HTTP side: the Starlette app and its routes, API keys, and the deadlines that keep a
slow client from holding a connection."""
