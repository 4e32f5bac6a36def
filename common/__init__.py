"""Code shared by the router and the model services that needs neither torch nor gRPC servers:
protocol constants, request limits, sampling-parameter checks, tokenizer identity, TLS
certificates and the reload of rotated files."""
