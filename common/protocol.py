"""Constants of the tandem.v1 contract, in one place for the services and the router."""

PROTOCOL = "tandem.v1"
# Trailing metadata of a FAILED_PRECONDITION cache miss: the seq_ids to resend from position 0, comma-separated.
CACHE_MISS_METADATA = "tandem-cache-miss"
# Most top alternatives a logprobs request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
# Call metadata naming the router that makes a call (the lease holder, common.proto LeaseRequest).
ROUTER_METADATA = "tandem-router"
# Trailing metadata of a FAILED_PRECONDITION refusal: another router holds the service's lease; its id.
NOT_OWNER_METADATA = "tandem-not-owner"
# Trailing metadata of a FAILED_PRECONDITION refusal: a step names a LoRA adapter the target does not hold
# (it restarted, or lost it): its name. The router loads it again and recomputes, as after a restart.
MISSING_ADAPTER_METADATA = "tandem-missing-lora"
