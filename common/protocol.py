"""Constants of the tandem.v1 contract, in one place for the services and the router."""

PROTOCOL = "tandem.v1"
# Trailing metadata of a FAILED_PRECONDITION cache miss: the seq_ids to resend from position 0, comma-separated.
CACHE_MISS_METADATA = "tandem-cache-miss"
# Most top alternatives a logprobs request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
