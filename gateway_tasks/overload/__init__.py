"""Load levels: the model, the controller, the level in Redis, its actions, the status (lua/overload/)."""
