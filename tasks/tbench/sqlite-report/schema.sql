CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer INTEGER, total REAL);
INSERT INTO customers VALUES (1, 'ada'), (2, 'bob'), (3, 'cyd');
INSERT INTO orders VALUES (1, 1, 20.0), (2, 2, 35.5), (3, 1, 30.0), (4, 3, 12.0), (5, 2, 5.0);
