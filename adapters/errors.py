class AdapterError(ValueError):
    """An adapter we refuse: the message names the file or field and what is wrong, in one sentence."""
