"""The gateway's NATS side: the mesh client (jobs out, token batches in, aborts), its link
state, and moving the requests of a worker that died."""
