"""Engine core: request state, KV block bookkeeping and the scheduler."""
