"""gRPC plumbing shared by every service: server bootstrap, interceptors, conversion, clients."""
