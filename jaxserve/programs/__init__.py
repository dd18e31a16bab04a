"""The jitted device programs (the model step, drafting, verification) and the shapes and arrays
they are compiled for."""
