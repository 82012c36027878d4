"""Engine <-> kvd RPC server on a Unix socket."""
