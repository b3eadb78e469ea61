"""Streaming client for the `lingbot_world` Triton model; run `python -m client --help`.

Modules: camera (poses, intrinsics), action (reference action dirs), images (first frame),
stream (gRPC streaming), video (MP4 and contact sheet). Nothing is imported here, so
`client.camera` works without tritonclient.
"""
