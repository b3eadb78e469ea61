"""The AR rollout: sessions, geometry, and the checks run before any weight is read."""
