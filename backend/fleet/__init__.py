"""Many groups behind one address: `python -m backend.fleet` starts N groups (each one launcher of
backend/launch/ and its tritonserver) or takes groups started elsewhere, checks that they serve one model
(`one_model`), puts HAProxy in front of them (`balancer`) and restarts a launcher that exits (`supervisor`);
`python -m backend.fleet restart|rolling-restart` drains and restarts a running fleet's groups, no world lost
(`restart`). It imports the server room (backend/launch/), never the other way."""
