"""What a run tells its user: logs, metrics, progress, profiles, the setup record, the watchdog."""
