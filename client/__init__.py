"""Streaming client for the `lingbot_world` Triton model; run `python -m client --help`.

Modules: camera (poses, intrinsics), action (reference action dirs), images (first frame),
stream (gRPC streaming), video (MP4 and contact sheet). Only `os` is imported here, so
`client.camera` works without tritonclient.
"""
import os

# The MP4 writer forks ffmpeg while gRPC stream threads run; gRPC's fork handlers then break its
# event loop ("epoll_wait error: Bad file descriptor"). Off unless the user chose otherwise.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
