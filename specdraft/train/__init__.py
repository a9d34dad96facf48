"""Training drafters on the target's own outputs: `distill` (the target's responses as token shards) and
`eagle` (an EAGLE-3 head on the target's features)."""
