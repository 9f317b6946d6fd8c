"""What the server and its clients agree on: statuses, the records the API returns and the
filters trials are listed by. Plain Python: nothing here imports server code (no database,
no Ray), so the client can import it."""
