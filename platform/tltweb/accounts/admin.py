from django.contrib import admin

from tltweb.accounts.models import ApiToken, Member, Team


class MemberInline(admin.TabularInline):
    model = Member
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]
    search_fields = ["name"]
    inlines = [MemberInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "token_hash", "created_at", "last_used_at"]
    search_fields = ["name", "user__username"]
