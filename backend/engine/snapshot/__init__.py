"""A steered session saved at a block boundary and opened again on any group layout (docs/worlds.md):
`capture` (what a rank copies out), `files` (one part as a safetensors file), `manifest` (the snapshot's table
of contents and its checks), `restore` (what a rank reads back), `sessions` (an engine's rank saving and resuming
a session), `size` (a snapshot's bytes, before it is written), `store` (ids, quota, time to live)."""
