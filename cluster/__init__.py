"""The cluster layer between the engine and the services: the prefix index and routing policies, the worker
runtime, the KV transport, auth and the wire conversions. It imports engine/ and protos/, never a service or kvflow/."""
