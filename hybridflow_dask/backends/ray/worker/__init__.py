"""The Ray backend's cluster side: the slot actor that hosts a slot's instances."""
