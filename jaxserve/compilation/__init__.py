"""Offline tools: ahead-of-time builds, the compile check, and the step's cost model read from the
compiled HLO."""
