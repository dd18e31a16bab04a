"""The host side of a step: executor, worker and model runner, which call the jitted programs."""
