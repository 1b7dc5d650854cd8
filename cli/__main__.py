from staleflow.cli.main import app

app(prog_name="staleflow")
