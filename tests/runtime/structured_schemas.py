"""A corpus of JSON schemas of real-world shape, each with a short prompt asking a model for such an object: the
structured-output tests (test_structured_schemas.py) and bench/structured.py run them all.

Each schema is small enough that a greedy answer of a small model ends within a few hundred tokens (SmolLM2:
38-600, most under 250): arrays have maxItems, free strings a maxLength (so do the formats whose digits are
unbounded: date-time, time and duration; greedy SmolLM2 wrote "P1000000..." to the token limit), and most objects
`additionalProperties: false` (OpenAI's strict mode; without it llguidance lets the model add properties of its
own). Between them they use nested objects, bounded arrays, enums, required fields, the formats date, date-time,
time, email, uuid, ipv4, ipv6, hostname, uri and duration, `$ref` into `$defs` (and `definitions`), anyOf, oneOf
(discriminated by a const), allOf, const, numeric bounds (inclusive and exclusive), pattern, patternProperties,
prefixItems, integer enums and nullable types. The prompts do not show the schema: the grammar alone makes the
answer valid.

What llguidance 1.9 refuses (EngineError "cannot be enforced"), so the corpus leaves out (REFUSED below keeps one
example of each; test_structured_schemas.py checks they are still refused, so a llguidance upgrade that starts
accepting one shows up):
- uniqueItems, contains / minContains, propertyNames, if / then / else, not, dependentRequired: "Unimplemented
  keys" (a warning, which GrammarBackend.matcher treats as an error: it would not be enforced);
- oneOf whose branches may overlap (two objects without a distinguishing const, or integer and number): llguidance
  cannot prove that only one branch matches and asks for `coerce_one_of` (oneOf over disjoint types, or objects
  told apart by a const property, is accepted);
- formats other than date-time, time, date, duration, email, hostname, ipv4, ipv6, uuid and uri (e.g.
  uri-reference, idn-email, json-pointer, regex): "Unknown format";
- look-around in a pattern ((?=...), (?!...)): the regex crate's syntax has none.
What llguidance accepts but does not fully enforce: its date format allows 29 February in every year (problem()
below lets that pass), and nothing bounds a number's digits (at temperature 0.8 SmolLM2 once wrote a longitude's
fraction to the token limit).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    schema: dict


def s(max_length: int = 40, **extra) -> dict:
    """A bounded string."""
    return {"type": "string", "maxLength": max_length, **extra}


def obj(properties: dict, required: list[str] | None = None, *, closed: bool = True, **extra) -> dict:
    """An object whose properties are all required unless `required` says otherwise; closed = no others."""
    out = {"type": "object", "properties": properties,
           "required": list(properties) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return {**out, **extra}


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def enum(*values) -> dict:
    return {"enum": list(values)}


def num(lo: float | None = None, hi: float | None = None, *, integer: bool = False) -> dict:
    out = {"type": "integer" if integer else "number"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def i(lo: int | None = None, hi: int | None = None) -> dict:
    return num(lo, hi, integer=True)


DATE = {"type": "string", "format": "date"}
DATETIME = {"type": "string", "format": "date-time", "maxLength": 35}   # the fraction of a second is unbounded
TIME = {"type": "string", "format": "time", "maxLength": 25}
EMAIL = {"type": "string", "format": "email", "maxLength": 60}
UUID = {"type": "string", "format": "uuid"}
IPV4 = {"type": "string", "format": "ipv4"}
IPV6 = {"type": "string", "format": "ipv6"}
URI = {"type": "string", "format": "uri", "maxLength": 80}
HOSTNAME = {"type": "string", "format": "hostname", "maxLength": 60}
BOOL = {"type": "boolean"}
CURRENCY = enum("USD", "EUR", "GBP", "JPY")


def nullable(schema: dict) -> dict:
    """["T", "null"] where the schema is a plain typed one, else anyOf [schema, null]."""
    if set(schema) <= {"type", "maxLength", "minLength", "format", "pattern"} and isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


ADDRESS = obj({"street": s(60), "city": s(40), "postal_code": s(12, pattern=r"^[A-Z0-9 -]{3,10}$"),
               "country": enum("US", "GB", "DE", "FR", "JP", "CA"), "line2": nullable(s(40))},
              ["street", "city", "postal_code", "country"])

CASES: list[Case] = [
    Case("invoice", "Give a JSON invoice for two items.", obj({
        "invoice_number": s(12, pattern=r"^INV-[0-9]{4}$"), "issued_on": DATE, "due_on": DATE,
        "customer": obj({"name": s(40), "email": EMAIL}),
        "items": arr(obj({"description": s(50), "quantity": i(1, 100), "unit_price": num(0, 10000)}), 2, 2),
        "currency": CURRENCY, "total": num(0)})),
    Case("user_profile", "Create a JSON user profile for a new member of a hiking forum.", obj({
        "id": UUID, "username": {"type": "string", "pattern": r"^[a-z0-9_]{3,16}$"}, "email": EMAIL,
        "age": i(13, 120), "bio": nullable(s(80)), "created_at": DATETIME})),
    Case("postal_address", "Write a JSON postal address for an office in Berlin.", {
        "$defs": {"address": ADDRESS}, "$ref": "#/$defs/address"}),
    Case("github_issue", "Produce a JSON object for a GitHub issue reporting a crash on startup.", obj({
        "number": i(1), "title": s(80), "state": enum("open", "closed"),
        "labels": arr(enum("bug", "enhancement", "question", "documentation", "good first issue"), 0, 3),
        "assignee": nullable(s(39, pattern=r"^[A-Za-z0-9-]{1,39}$")), "created_at": DATETIME,
        "body": s(200)})),
    Case("product", "Describe a wooden desk lamp as a JSON product record.", obj({
        "sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{3}$"}, "name": s(50), "price": num(0, 10000),
        "in_stock": BOOL, "tags": arr(s(15), 0, 4),
        "dimensions": obj({"width": num(0, 500), "height": num(0, 500), "depth": num(0, 500),
                           "unit": enum("cm", "in")})})),
    Case("recipe", "Give me a pancake recipe as JSON.", obj({
        "title": s(50), "servings": i(1, 12), "prep_minutes": i(0, 240),
        "ingredients": arr(obj({"name": s(30), "amount": num(0, 1000),
                                "unit": enum("g", "ml", "cup", "tbsp", "tsp", "piece")}), 2, 6),
        "steps": arr(s(100), 1, 4)})),
    Case("calendar_event", "Create a JSON calendar event for a team meeting next Monday.", obj({
        "title": s(60), "start": DATETIME, "end": DATETIME, "location": nullable(s(60)),
        "attendees": arr(EMAIL, 0, 3), "all_day": BOOL})),
    Case("api_error", "Return a JSON error response for a request with a missing API key.", obj({
        "error": obj({"code": i(400, 599), "type": enum("invalid_request", "authentication", "rate_limit",
                                                        "server_error"),
                      "message": s(100), "request_id": UUID})})),
    Case("server_config", "Write a JSON configuration for a small web server.", obj({
        "host": IPV4, "port": i(1, 65535), "workers": i(1, 64),
        "log_level": enum("debug", "info", "warning", "error"),
        "tls": obj({"enabled": BOOL, "cert_path": nullable(s(60))})})),
    Case("weather_report", "Give today's weather in Lisbon as JSON.", obj({
        "city": s(40), "date": DATE, "temperature_c": num(-60, 60),
        "conditions": enum("sunny", "cloudy", "rain", "snow", "storm", "fog"), "humidity": i(0, 100),
        "wind": obj({"speed_kmh": num(0, 300), "direction": enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")})})),
    Case("book", "Give a JSON record for a classic science fiction novel.", obj({
        "title": s(80), "authors": arr(s(40), 1, 3), "isbn": {"type": "string", "pattern": r"^97[89][0-9]{10}$"},
        "published": DATE, "genres": arr(enum("science fiction", "fantasy", "mystery", "romance", "history"), 1, 2),
        "rating": num(0, 5)})),
    Case("order_webhook", "Send a JSON webhook payload saying order 1042 has shipped.", obj({
        "event": {"const": "order.updated"}, "id": UUID, "timestamp": DATETIME,
        "data": obj({"order_id": i(1), "status": enum("pending", "paid", "shipped", "delivered", "cancelled"),
                     "total": num(0), "currency": CURRENCY})})),
    Case("payment", "Give a JSON payment of 25 euros paid by card.", obj({
        "amount": num(0.01, 100000), "currency": CURRENCY,
        "method": {"oneOf": [
            obj({"type": {"const": "card"}, "brand": enum("visa", "mastercard", "amex"),
                 "last4": {"type": "string", "pattern": r"^[0-9]{4}$"}}),
            obj({"type": {"const": "bank_transfer"},
                 "iban": {"type": "string", "pattern": r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}}),
            obj({"type": {"const": "paypal"}, "email": EMAIL})]}})),
    Case("contact_form", "Fill in a website contact form as JSON asking about opening hours.", obj({
        "name": s(40), "email": EMAIL, "subject": enum("sales", "support", "general", "press"),
        "message": s(200), "newsletter": BOOL})),
    Case("employee", "Give a JSON employee record for a software engineer with a home and an office address.", {
        "$defs": {"address": ADDRESS},
        **obj({"employee_id": {"type": "string", "pattern": r"^E[0-9]{5}$"}, "full_name": s(50), "email": EMAIL,
               "department": enum("engineering", "sales", "finance", "hr"), "hired_on": DATE,
               "home": {"$ref": "#/$defs/address"}, "office": {"$ref": "#/$defs/address"},
               "manager_id": nullable({"type": "string", "pattern": r"^E[0-9]{5}$"})})}),
    Case("flight_booking", "Give a JSON flight booking for one passenger from Paris to New York.", {
        "$defs": {"passenger": obj({"first_name": s(30), "last_name": s(30), "date_of_birth": DATE}),
                  "segment": obj({"from": {"type": "string", "pattern": r"^[A-Z]{3}$"},
                                  "to": {"type": "string", "pattern": r"^[A-Z]{3}$"}, "departure": DATETIME,
                                  "flight": {"type": "string", "pattern": r"^[A-Z]{2}[0-9]{2,4}$"}})},
        **obj({"booking_ref": {"type": "string", "pattern": r"^[A-Z0-9]{6}$"},
               "passengers": arr({"$ref": "#/$defs/passenger"}, 1, 2),
               "segments": arr({"$ref": "#/$defs/segment"}, 1, 2),
               "cabin": enum("economy", "premium", "business", "first")})}),
    Case("log_entry", "Write one structured JSON log line for a failed database connection.", obj({
        "timestamp": DATETIME, "level": enum("DEBUG", "INFO", "WARN", "ERROR"), "service": s(30),
        "host": IPV4, "message": s(120), "trace_id": {"type": "string", "pattern": r"^[0-9a-f]{16}$"}})),
    Case("movie", "Give a JSON entry for a famous film from the 1990s.", obj({
        "title": s(60), "year": i(1900, 2030), "director": s(40), "cast": arr(s(40), 1, 3),
        "runtime_minutes": i(1, 400), "rating": enum("G", "PG", "PG-13", "R")})),
    Case("todo_list", "Make a JSON to-do list for moving house.", obj({
        "list": s(40), "items": arr(obj({"id": i(1), "task": s(60), "done": BOOL,
                                         "due": {"type": ["string", "null"], "format": "date"}}), 1, 5)})),
    Case("bank_transaction", "Give a JSON bank transaction for a rent payment.", obj({
        "id": UUID, "amount": num(-1000000, 1000000), "currency": CURRENCY, "direction": enum("debit", "credit"),
        "counterparty": obj({"name": s(50), "iban": {"type": "string",
                                                     "pattern": r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}}),
        "booked_on": DATE, "reference": nullable(s(40))})),
    Case("place", "Give the Eiffel Tower as a JSON place with coordinates.", obj({
        "name": s(60), "latitude": num(-90, 90), "longitude": num(-180, 180),
        "category": enum("landmark", "restaurant", "museum", "park", "hotel", "shop")})),
    Case("package_json", "Write a minimal package.json for a small command-line tool.", obj({
        "name": {"type": "string", "pattern": r"^[a-z][a-z0-9-]{1,30}$"},
        "version": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"}, "description": s(80),
        "license": enum("MIT", "Apache-2.0", "BSD-3-Clause", "GPL-3.0"),
        "dependencies": {"type": "object", "maxProperties": 3,
                         "additionalProperties": {"type": "string", "pattern": r"^\^?[0-9]+\.[0-9]+\.[0-9]+$"}}})),
    Case("compose_service", "Write a JSON docker-compose service definition for a Redis cache.", obj({
        "image": s(40), "ports": arr({"type": "string", "pattern": r"^[0-9]{2,5}:[0-9]{2,5}$"}, 0, 2),
        "environment": {"type": "object", "maxProperties": 3, "additionalProperties": s(40)},
        "restart": enum("no", "always", "on-failure", "unless-stopped")})),
    Case("k8s_deployment", "Write a Kubernetes deployment for an nginx web server as JSON.", obj({
        "apiVersion": {"const": "apps/v1"}, "kind": {"const": "Deployment"},
        "metadata": obj({"name": {"type": "string", "pattern": r"^[a-z][a-z0-9-]{0,30}$"},
                         "labels": obj({"app": s(30)})}),
        "spec": obj({"replicas": i(1, 10), "image": s(50), "containerPort": i(1, 65535)})})),
    Case("chat_request", "Write a JSON chat completion request asking a model to say hello.", obj({
        "model": enum("gpt-4o", "gpt-4o-mini", "llama-3-8b"),
        "messages": arr(obj({"role": enum("system", "user", "assistant"), "content": s(100)}), 1, 3),
        "temperature": num(0, 2), "max_tokens": i(1, 4096), "stream": BOOL})),
    Case("http_request", "Describe, as JSON, an HTTP request that fetches a user's profile.", obj({
        "method": enum("GET", "POST", "PUT", "PATCH", "DELETE"), "url": URI,
        "headers": {"type": "object", "maxProperties": 3, "additionalProperties": s(60)},
        "body": nullable(s(100))})),
    Case("sensor_reading", "Give a JSON reading from a greenhouse sensor.", obj({
        "device_id": UUID, "recorded_at": DATETIME,
        "readings": arr(obj({"metric": enum("temperature", "humidity", "co2", "light"), "value": num(-100, 10000)}),
                        1, 4),
        "battery": i(0, 100)})),
    Case("job_posting", "Write a JSON job posting for a remote data analyst.", obj({
        "title": s(60), "company": s(40), "location": obj({"city": nullable(s(40)), "remote": BOOL}),
        "salary": obj({"min": i(0, 1000000), "max": i(0, 1000000), "currency": CURRENCY}),
        "employment_type": enum("full-time", "part-time", "contract", "internship"),
        "skills": arr(s(25), 1, 4)})),
    Case("restaurant_review", "Review a pizza place as a JSON object.", obj({
        "restaurant": s(50), "rating": i(1, 5), "visited_on": DATE, "pros": arr(s(40), 0, 3),
        "cons": arr(s(40), 0, 3), "would_return": BOOL})),
    Case("shipping_label", "Create a JSON shipping label for a parcel from London to Toronto.", {
        "$defs": {"address": ADDRESS},
        **obj({"tracking_number": {"type": "string", "pattern": r"^1Z[0-9A-Z]{16}$"},
               "carrier": enum("UPS", "FedEx", "DHL", "USPS"), "sender": {"$ref": "#/$defs/address"},
               "recipient": {"$ref": "#/$defs/address"}, "weight_kg": {"type": "number", "exclusiveMinimum": 0,
                                                                     "maximum": 70}})}),
    Case("student_grades", "Give a student's grades for one term as JSON.", obj({
        "student": obj({"id": {"type": "string", "pattern": r"^S[0-9]{6}$"}, "name": s(40)}),
        "term": enum("fall", "spring", "summer"),
        "courses": arr(obj({"code": {"type": "string", "pattern": r"^[A-Z]{2,4}[0-9]{3}$"},
                            "grade": enum("A", "B", "C", "D", "F"), "credits": i(1, 6)}), 1, 4),
        "gpa": num(0, 4)})),
    Case("network_device", "Describe a network switch as JSON, with its interfaces.", obj({
        "hostname": HOSTNAME, "mgmt_ip": IPV4, "mgmt_ipv6": nullable(IPV6),
        "interfaces": arr(obj({"name": {"type": "string", "pattern": r"^(eth|wlan)[0-9]$"}, "ip": IPV4, "up": BOOL}),
                          1, 3),
        "vlan": i(1, 4094)})),
    Case("medication", "Give a JSON prescription entry for an antibiotic.", obj({
        "name": s(40), "dosage_mg": num(0, 2000),
        "frequency": enum("once daily", "twice daily", "three times daily", "as needed"), "start_date": DATE,
        "end_date": {"type": ["string", "null"], "format": "date"}, "with_food": BOOL})),
    Case("feature_flag", "Define a JSON feature flag for a new checkout page.", obj({
        "key": {"type": "string", "pattern": r"^[a-z][a-z_]{2,30}$"}, "enabled": BOOL, "rollout_percent": i(0, 100),
        "environments": arr(enum("dev", "staging", "production"), 1, 3), "owner": EMAIL})),
    Case("oauth_token", "Return a JSON OAuth token response.", obj({
        "access_token": {"type": "string", "pattern": r"^[A-Za-z0-9]{20,40}$"}, "token_type": {"const": "Bearer"},
        "expires_in": i(60, 86400), "scope": s(60), "refresh_token": {"type": ["string", "null"], "maxLength": 40}})),
    Case("paged_response", "Give a JSON API response with the first page of three users.", obj({
        "data": arr(obj({"id": i(1), "name": s(40)}), 1, 3), "page": i(1), "per_page": i(1, 100), "total": i(0),
        "next": nullable(URI)})),
    Case("email_message", "Write a JSON email message inviting two colleagues to lunch.", obj({
        "from": EMAIL, "to": arr(EMAIL, 1, 3), "cc": arr(EMAIL, 0, 2), "subject": s(60), "sent_at": DATETIME,
        "attachments": arr(obj({"filename": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,20}\.(pdf|png|txt)$"},
                                "size_bytes": i(0, 10000000)}), 0, 2)})),
    Case("bug_report", "File a JSON bug report about a login button that does nothing.", obj({
        "severity": enum("low", "medium", "high", "critical"), "component": s(30),
        "steps_to_reproduce": arr(s(60), 1, 4), "expected": s(80), "actual": s(80),
        "environment": obj({"os": enum("windows", "macos", "linux", "android", "ios"),
                            "app_version": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"}})})),
    Case("git_commit", "Describe a git commit that fixes a typo in the README, as JSON.", obj({
        "sha": {"type": "string", "pattern": r"^[0-9a-f]{40}$"}, "author": obj({"name": s(40), "email": EMAIL}),
        "date": DATETIME, "message": s(72), "files_changed": i(0, 1000)})),
    Case("pull_request", "Give a JSON pull request that adds dark mode.", obj({
        "number": i(1), "title": s(70), "head": {"type": "string", "pattern": r"^[a-z0-9/_-]{1,40}$"},
        "base": {"const": "main"}, "draft": BOOL,
        "reviewers": arr({"type": "string", "pattern": r"^[A-Za-z0-9-]{1,20}$"}, 0, 3),
        "status": enum("open", "merged", "closed")})),
    Case("hotel_reservation", "Give a JSON hotel reservation for two nights in Rome.", obj({
        "guest": s(50), "check_in": DATE, "check_out": DATE, "room_type": enum("single", "double", "suite"),
        "guests": i(1, 4), "breakfast": BOOL, "total_price": num(0, 100000), "currency": CURRENCY})),
    Case("survey_response", "Give a JSON survey response with answers to three questions.", obj({
        "respondent_id": UUID,
        "answers": arr(obj({"question_id": i(1, 50), "answer": {"anyOf": [i(1, 5), s(60)]}}), 3, 3),
        "completed_at": DATETIME})),
    Case("org_chart", "Give a JSON org chart of a small startup: the CEO and two direct reports.", {
        "definitions": {"person": obj({"name": s(40), "title": s(40)}),
                        "manager": obj({"name": s(40), "title": s(40),
                                        "reports": arr({"$ref": "#/definitions/person"}, 0, 3)})},
        **obj({"company": s(40), "ceo": {"$ref": "#/definitions/manager"}})}),
    Case("vehicle", "Give a JSON listing for a used hatchback car.", obj({
        "vin": {"type": "string", "pattern": r"^[A-HJ-NPR-Z0-9]{17}$"}, "make": s(30), "model": s(30),
        "year": i(1950, 2030), "fuel": enum("petrol", "diesel", "electric", "hybrid"), "mileage_km": i(0, 1000000),
        "price": num(0)})),
    Case("stock_quote", "Give a JSON stock quote for Apple.", obj({
        "symbol": {"type": "string", "pattern": r"^[A-Z]{1,5}$"}, "exchange": enum("NASDAQ", "NYSE", "LSE", "TSE"),
        "price": {"type": "number", "exclusiveMinimum": 0}, "change_percent": num(-100, 100), "volume": i(0),
        "as_of": DATETIME})),
    Case("social_post", "Write a JSON social media post announcing a product launch.", obj({
        "id": {"type": "string", "pattern": r"^[0-9]{10,19}$"},
        "author": obj({"handle": {"type": "string", "pattern": r"^@[A-Za-z0-9_]{1,15}$"}, "verified": BOOL}),
        "text": s(140), "hashtags": arr({"type": "string", "pattern": r"^#[A-Za-z0-9_]{1,20}$"}, 0, 3),
        "posted_at": DATETIME, "likes": i(0)})),
    Case("app_settings", "Write the JSON settings file of a note-taking app.", obj({
        "theme": enum("light", "dark", "system"), "language": {"type": "string", "pattern": r"^[a-z]{2}(-[A-Z]{2})?$"},
        "font_size": i(10, 24),
        "notifications": obj({"email": BOOL, "push": BOOL, "digest": enum("daily", "weekly", "never")}),
        "autosave_seconds": {"enum": [0, 30, 60, 300]}})),
    Case("db_config", "Write a JSON database connection config for PostgreSQL.", obj({
        "driver": enum("postgres", "mysql", "sqlite"), "host": {"anyOf": [IPV4, HOSTNAME]}, "port": i(1, 65535),
        "database": {"type": "string", "pattern": r"^[a-z_][a-z0-9_]{0,30}$"}, "user": s(30),
        "pool": obj({"min": i(0, 10), "max": i(1, 100)}),
        "ssl_mode": enum("disable", "require", "verify-full")})),
    Case("ci_pipeline", "Write a JSON CI pipeline that runs tests on every push.", obj({
        "name": s(40), "on": arr(enum("push", "pull_request", "schedule"), 1, 2),
        "jobs": arr(obj({"name": s(30), "runs_on": enum("ubuntu-latest", "macos-latest", "windows-latest"),
                         "steps": arr(s(50), 1, 3),
                         "timeout": {"type": "string", "format": "duration", "maxLength": 20}}), 1, 2)})),
    Case("eth_transaction", "Give a JSON Ethereum transaction sending 0.5 ETH.", obj({
        "from": {"type": "string", "pattern": r"^0x[0-9a-f]{40}$"},
        "to": {"type": "string", "pattern": r"^0x[0-9a-f]{40}$"},
        "value_eth": num(0, 1000000), "gas": i(21000, 10000000), "status": enum("pending", "confirmed", "failed")})),
    Case("appointment", "Book a JSON doctor's appointment for a check-up.", obj({
        "patient": s(50), "doctor": s(50), "starts_at": DATETIME, "duration_minutes": {"enum": [15, 30, 45, 60]},
        "reason": s(80), "telehealth": BOOL})),
    Case("opening_hours", "Give a bakery's opening hours for Monday and Saturday as JSON.", obj({
        "shop": s(40),
        "hours": arr(obj({"day": enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"), "opens": TIME,
                          "closes": TIME}), 2, 2),
        "closed_on_holidays": BOOL})),
    Case("translation", "Translate 'good morning' into French and return it as JSON.", obj({
        "source_lang": enum("en", "fr", "de", "es", "it"), "target_lang": enum("en", "fr", "de", "es", "it"),
        "text": s(100), "translation": s(100), "confidence": num(0, 1)})),
    Case("sentiment", "Classify the sentiment of 'The food was cold and late.' as JSON.", obj({
        "label": enum("positive", "negative", "neutral"), "confidence": num(0, 1), "keywords": arr(s(20), 0, 3)})),
    Case("entities", "Extract the named entities of 'Ada Lovelace worked with Charles Babbage in London.' as JSON.",
         obj({"entities": arr(obj({"text": s(40), "type": enum("PERSON", "ORG", "LOCATION", "DATE"),
                                   "start": i(0, 1000)}), 1, 4)})),
    Case("nutrition", "Give the nutrition facts of a granola bar as JSON.", obj({
        "product": s(40), "serving_size_g": num(0, 1000), "calories": i(0, 2000),
        "macros": obj({"protein_g": num(0, 200), "fat_g": num(0, 200), "carbs_g": num(0, 200)}),
        "allergens": arr(enum("gluten", "nuts", "milk", "soy", "eggs"), 0, 3)})),
    Case("support_ticket", "Open a JSON support ticket for a customer who cannot reset her password.", obj({
        "id": {"type": "string", "pattern": r"^TCK-[0-9]{5}$"}, "priority": enum("low", "normal", "high", "urgent"),
        "status": {"const": "open"}, "customer": obj({"name": s(40), "email": EMAIL}), "opened_at": DATETIME,
        "messages": arr(obj({"from": enum("customer", "agent"), "body": s(120)}), 1, 2)})),
    Case("geojson_point", "Give the location of the Sydney Opera House as a GeoJSON Feature.", obj({
        "type": {"const": "Feature"},
        "geometry": obj({"type": {"const": "Point"},
                         "coordinates": {"type": "array", "prefixItems": [num(-180, 180), num(-90, 90)],
                                         "items": False, "minItems": 2}}),
        "properties": obj({"name": s(60)})})),
    Case("tool_call", "Call a tool, as JSON, to get the weather in Madrid in celsius.", obj({
        "name": enum("get_weather", "search_flights"),
        "arguments": {"anyOf": [
            obj({"city": s(40), "unit": enum("celsius", "fahrenheit")}),
            obj({"origin": {"type": "string", "pattern": r"^[A-Z]{3}$"},
                 "destination": {"type": "string", "pattern": r"^[A-Z]{3}$"}, "date": DATE})]}})),
    Case("match_result", "Give the result of a football match as JSON.", obj({
        "home_team": s(40), "away_team": s(40), "score": obj({"home": i(0, 20), "away": i(0, 20)}),
        "played_on": DATE, "venue": s(50), "status": enum("scheduled", "live", "finished", "postponed")})),
    Case("dns_records", "Give the DNS records of example.com (an A record and an MX record) as JSON.", obj({
        "zone": HOSTNAME,
        "records": arr({"oneOf": [
            obj({"type": {"const": "A"}, "name": s(40), "address": IPV4, "ttl": i(60, 86400)}),
            obj({"type": {"const": "AAAA"}, "name": s(40), "address": IPV6, "ttl": i(60, 86400)}),
            obj({"type": {"const": "MX"}, "name": s(40), "exchange": HOSTNAME, "priority": i(0, 100)})]}, 1, 3)})),
    Case("audit_event", "Record a JSON audit event: an admin deleted a user account.", {"allOf": [
        {"type": "object", "properties": {"id": UUID, "occurred_at": DATETIME}, "required": ["id", "occurred_at"]},
        {"type": "object", "properties": {"actor": EMAIL, "action": enum("create", "update", "delete", "login"),
                                          "target": s(40)},
         "required": ["actor", "action", "target"]}],
        "maxProperties": 5}),
    Case("experiment_config", "Write a JSON config for a machine-learning training run.", obj({
        "run_name": {"type": "string", "pattern": r"^[a-z0-9-]{3,30}$"},
        "learning_rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "batch_size": {"enum": [8, 16, 32, 64, 128]}, "epochs": i(1, 100),
        "optimizer": obj({"name": enum("adam", "adamw", "sgd"), "weight_decay": num(0, 1)}),
        "seed": nullable(i(0, 2 ** 31 - 1))})),
    Case("metrics_labels", "Give a JSON metric sample with a few labels for an HTTP request counter.", {
        "type": "object",
        "properties": {"metric": {"type": "string", "pattern": r"^[a-z_]{3,40}$"}, "value": num(0),
                       "labels": {"type": "object", "maxProperties": 3,
                                  "patternProperties": {"^[a-z_]{1,20}$": s(30)}, "additionalProperties": False}},
        "required": ["metric", "value", "labels"], "additionalProperties": False}),
    Case("rgb_palette", "Give a JSON color palette of three colors for a beach website.", obj({
        "name": s(40), "colors": arr(obj({"name": s(20), "hex": {"type": "string", "pattern": r"^#[0-9a-f]{6}$"},
                                          "rgb": {"type": "array", "items": i(0, 255), "minItems": 3,
                                                  "maxItems": 3}}), 3, 3)})),
    Case("open_object", "Give a JSON record of a library loan: the book title, the member and the due date.", {
        "type": "object",
        "properties": {"title": s(60), "member": s(40), "due": DATE},
        "required": ["title", "member", "due"], "maxProperties": 4}),
]

# One example per feature llguidance refuses (see the module docstring).
REFUSED: dict[str, dict] = {
    "uniqueItems": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "if": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "uri-reference": {"type": "string", "format": "uri-reference"},
    "look-around": {"type": "string", "pattern": "^(?=.*[A-Z]).{8,}$"},
}

assert len({c.name for c in CASES}) == len(CASES)


# ---- checking an output ----------------------------------------------------------------------------------------

_DATE = r"(\d{4})-(\d{2})-(\d{2})"
_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
_DURATION = re.compile(r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s<>\"{}|\\^`]*")
_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _rfc3339_time(v: str) -> bool:
    m = re.fullmatch(_TIME, v)
    return bool(m) and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) <= 60 and \
        (m[6] is None or (int(m[6]) < 24 and int(m[7]) < 60))


def _rfc3339_date(v: str) -> bool:
    """RFC 3339's full-date, except that 29 February passes in any year: llguidance's date format does not know
    leap years (sampled SmolLM2 wrote 2023-02-29), and no regex-sized grammar would."""
    m = re.fullmatch(_DATE, v)
    return bool(m) and 1 <= int(m[2]) <= 12 and 1 <= int(m[3]) <= _DAYS[int(m[2]) - 1]


def _rfc3339_date_time(v: str) -> bool:
    parts = re.split("[Tt ]", v, maxsplit=1)
    return len(parts) == 2 and _rfc3339_date(parts[0]) and _rfc3339_time(parts[1])


def format_checker():
    """jsonschema's FormatChecker with RFC 3339 date, time and date-time (its own "time" is draft 3's HH:MM:SS,
    its "date" Python's, which refuses year 0000, and date-time needs an extra package), uri (a scheme and no
    spaces), hostname and duration added by hand."""
    import jsonschema
    checker = jsonschema.FormatChecker()
    for name, check in (("date", _rfc3339_date), ("time", _rfc3339_time), ("date-time", _rfc3339_date_time),
                        ("uri", lambda v: bool(_URI.fullmatch(v))),
                        ("duration", lambda v: bool(_DURATION.fullmatch(v))),
                        ("hostname", lambda v: len(v) <= 253 and all(_LABEL.fullmatch(p) for p in v.split(".")))):
        checker.checks(name)(lambda v, check=check: not isinstance(v, str) or check(v))
    return checker


def problem(case: Case, text: str) -> str | None:
    """Why `text` is not a valid answer to `case` (not JSON, or not valid under its schema, formats included),
    or None."""
    import jsonschema
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON ({e})"
    try:
        jsonschema.validate(value, case.schema, format_checker=format_checker())
    except jsonschema.ValidationError as e:
        return f"{e.message} at {list(e.absolute_path)}"
    return None
