"""``regroup whatif``: what a churn rate would cost a job, from the job's own recorded re-forms.

``recorded`` reads the stalls of training from the spans, ``costs`` turns them into what
one re-form of each kind costs in place and with restarted workers, ``churn`` holds the
question asked, ``model`` the expected goodput of each strategy (its docstring has the
formulas), ``command`` the CLI.
"""
