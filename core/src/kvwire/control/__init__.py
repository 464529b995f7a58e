"""The control plane: wire schema, control channel, bootstrap service, handshake rules."""
