"""The process group: bootstrap, and the Ulysses sequence <-> head shard exchanges."""
