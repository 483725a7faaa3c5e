"""Worker groups: what the engine core drives, one group per backend."""
