from jaxopt_train.cli import run

run()
