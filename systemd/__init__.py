"""The systemd unit templates (package data read by `specctl install-service`)."""
