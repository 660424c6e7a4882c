"""The KV transport's one home: the transfer contract, the gRPC and torch.distributed link backends."""
