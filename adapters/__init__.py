"""PEFT adapter parsing, validation and the artifact store, shared by the engine and the control plane."""
