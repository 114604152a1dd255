"""Instance servers (prefill, decode, colocated, relay, main) and the router."""
