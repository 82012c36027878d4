"""kvd <-> kvd control plane: ZMQ sockets and the registry of remote ranks."""
