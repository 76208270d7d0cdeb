"""Tasks off the plain queue path: held on dependencies, cancelled (lua/lifecycle/)."""
