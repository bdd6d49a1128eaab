"""What a run leaves behind, and where: the run's own folder (``run_folder``) and the pictures,
tables, files and final summary sent to every configured logger in its own form (``to_loggers``)."""
__all__ = ["run_folder", "to_loggers"]
