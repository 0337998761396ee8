"""Where a request goes: pure policy over heartbeats and the KV index of who holds which block."""
