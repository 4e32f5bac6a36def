"""The target-model gRPC service: scores mixed batches, samples and runs the acceptance rule."""
