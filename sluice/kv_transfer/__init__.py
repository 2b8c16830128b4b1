"""KV connectors: implementations of the connector interface (sluice/core/kv_connector.py on
the scheduler's side, sluice/worker/kv_connector.py on the workers'), chosen by name with
`kv_transfer_config` (see factory.py); `pool/` is the storage of the global KV pool shared by
instances."""
