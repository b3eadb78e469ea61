"""One group's server: `python -m backend.launch` renders the model repository (config.pbtxt from the wire contract
and the settings) and runs a real tritonserver from the nvidia-pytriton wheel (`--mpi`: this host's server among
all hosts'), then keeps it: it heals a failed group, serves the group's capacity to a balancer (`agent`), drains its
worlds elsewhere at SIGTERM and reloads its users' keys at SIGHUP. Beside it what else starts or tends one group:
`local_group` (its members as local processes, no tritonserver: tests, benchmarks), `generated` (config.pbtxt and
docs/api.md written again), `keys` (a user's key), `perf_analyzer`, and what /proc and a metrics page say about a
server (`procfs`, `metrics_page`). Many groups behind one address are the fleet's (backend/fleet/), which imports
this room; this room never imports it."""
