"""The loraplex control plane: tenants, keys, adapters, quotas, usage and the OpenAI gateway."""
