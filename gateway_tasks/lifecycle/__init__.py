"""Tasks off the plain queue path: held on dependencies, cancelled, evicted (lua/lifecycle/)."""
