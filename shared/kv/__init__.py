"""The KV data plane: what a request's KV bytes are (spec), how they are received
(receive), and how a worker announces the blocks it holds (events)."""
