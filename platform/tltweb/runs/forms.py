from django import forms

from workers.tlt.config import PRESETS


class LaunchForm(forms.Form):
    team = forms.TypedChoiceField(coerce=int)
    name = forms.CharField(max_length=200, required=False)
    preset = forms.ChoiceField(choices=[(p, p) for p in PRESETS])
    config_yaml = forms.CharField(widget=forms.Textarea(attrs={"rows": 28, "spellcheck": "false"}), required=False)
    tags = forms.CharField(max_length=500, required=False, help_text="comma separated")
    notes = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False)

    def __init__(self, *args, teams=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].choices = [(t.pk, t.name) for t in teams]


class RunEditForm(forms.Form):
    name = forms.CharField(max_length=200)
    tags = forms.CharField(max_length=500, required=False)
    notes = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), required=False)


class SampleFilterForm(forms.Form):
    """The sample viewer's GET filters (all optional)."""

    step = forms.IntegerField(min_value=0, required=False)
    min_reward = forms.FloatField(required=False, label="reward ≥")
    max_reward = forms.FloatField(required=False, label="reward ≤")
    min_length = forms.IntegerField(min_value=0, required=False, label="length ≥")
    max_length = forms.IntegerField(min_value=0, required=False, label="length ≤")
